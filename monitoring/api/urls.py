from django.urls import path

from . import alerts, drift, feedback

urlpatterns = [
    # Ground truth, the prediction log and online quality.
    path("feedback", feedback.FeedbackView.as_view()),
    path("models/<str:name>/predictions", feedback.PredictionListView.as_view()),
    path("models/<str:name>/quality", feedback.QualityView.as_view()),
    # Drift: a version's reference sample and the model's reports.
    path("models/<str:name>/versions/<int:version>/reference", drift.ReferenceView.as_view()),
    path("models/<str:name>/drift", drift.DriftReportListView.as_view()),
    # Alerts and where they are posted.
    path("alerts", alerts.AlertListView.as_view()),
    path("alerts/<int:alert_id>", alerts.AlertDetailView.as_view()),
    path("alerts/<int:alert_id>/resolve", alerts.AlertResolveView.as_view()),
    path("alert-settings", alerts.AlertSettingsView.as_view()),
]
