from django.urls import path

from . import feedback, views

urlpatterns = [
    path("models/<str:name>/predict", views.PredictView.as_view()),
    path("models/<str:name>/versions/<int:version>/predict", views.PredictView.as_view()),
    path("agent/artifacts/<int:version_id>", views.ArtifactView.as_view()),
]

# Ground truth, the prediction log and online quality (gateway.api.feedback).
urlpatterns += [
    path("feedback", feedback.FeedbackView.as_view()),
    path("models/<str:name>/predictions", feedback.PredictionListView.as_view()),
    path("models/<str:name>/quality", feedback.QualityView.as_view()),
]
