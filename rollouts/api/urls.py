from django.urls import path

from . import views

urlpatterns = [
    path("models/<str:name>/rollouts", views.PlanListView.as_view()),
    path("rollouts/<int:plan_id>", views.PlanDetailView.as_view()),
    path("rollouts/<int:plan_id>/weight", views.PlanWeightView.as_view()),
    path("rollouts/<int:plan_id>/kill", views.PlanKillView.as_view()),
    path("audit", views.AuditView.as_view()),
]
