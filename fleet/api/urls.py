from django.urls import path

from . import views

urlpatterns = [
    path("deployments", views.DeploymentListView.as_view()),
    path("deployments/<int:deployment_id>", views.DeploymentDetailView.as_view()),
    path("deployments/<int:deployment_id>/decisions", views.DecisionListView.as_view()),
    path("pools", views.PoolListView.as_view()),
    path("agents", views.AgentListView.as_view()),
    path("models/<str:name>/rightsizing", views.RightsizingView.as_view()),
    path("models/<str:name>/versions/<int:version>/placements", views.PlacementListView.as_view()),
    # Agents download the artifacts of versions assigned to their node (node token).
    path("agent/artifacts/<int:version_id>", views.ArtifactView.as_view()),
    path("agent/tokenizers/<int:version_id>", views.TokenizerView.as_view()),
]
