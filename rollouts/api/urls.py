from django.urls import path

from . import import_views, rollback_views, views

urlpatterns = [
    # A model's settings include its fallback ladder, which the traffic gate judges.
    path("models/<str:name>", views.ModelDetailView.as_view()),
    path("models/<str:name>/rollouts", views.PlanListView.as_view()),
    path("models/<str:name>/versions/import", import_views.MlflowImportView.as_view()),
    path("models/<str:name>/promotions", views.PromotionListView.as_view()),
    path("models/<str:name>/aliases/<str:alias>", views.AliasView.as_view()),
    path(
        "models/<str:name>/aliases/<str:alias>/rollback",
        rollback_views.AliasRollbackView.as_view(),
    ),
    path(
        "models/<str:name>/aliases/<str:alias>/history/<int:change_id>/review",
        rollback_views.AliasReviewView.as_view(),
    ),
    path("models/<str:name>/policy", views.ModelPolicyView.as_view()),
    path("models/<str:name>/freeze-override", views.FreezeOverrideView.as_view()),
    path("policy", views.TenantPolicyView.as_view()),
    path("rollouts/<int:plan_id>", views.PlanDetailView.as_view()),
    path("rollouts/<int:plan_id>/weight", views.PlanWeightView.as_view()),
    path("rollouts/<int:plan_id>/arms", views.PlanArmsView.as_view()),
    path("rollouts/<int:plan_id>/kill", views.PlanKillView.as_view()),
    path("rollouts/<int:plan_id>/pause", views.PlanPauseView.as_view()),
    path("rollouts/<int:plan_id>/resume", views.PlanResumeView.as_view()),
    path("rollouts/<int:plan_id>/promotion", views.PlanPromotionView.as_view()),
    path("rollouts/<int:plan_id>/metrics", views.PlanMetricsView.as_view()),
    path("approvals", views.ApprovalListView.as_view()),
    path("approvals/<int:request_id>", views.ApprovalDetailView.as_view()),
    path("approvals/<int:request_id>/approve", views.ApproveView.as_view()),
    path("approvals/<int:request_id>/reject", views.RejectView.as_view()),
]
