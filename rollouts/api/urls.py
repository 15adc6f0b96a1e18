from django.urls import path

from . import views

urlpatterns = [
    path("models/<str:name>/rollouts", views.PlanListView.as_view()),
    path("models/<str:name>/promotions", views.PromotionListView.as_view()),
    path("models/<str:name>/aliases/<str:alias>", views.AliasView.as_view()),
    path("rollouts/<int:plan_id>", views.PlanDetailView.as_view()),
    path("rollouts/<int:plan_id>/weight", views.PlanWeightView.as_view()),
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
