from django.urls import path

from . import alerts, drift, feedback, generations, usage

urlpatterns = [
    # Ground truth, the prediction log and online quality.
    path("feedback", feedback.FeedbackView.as_view()),
    path("models/<str:name>/predictions", feedback.PredictionListView.as_view()),
    path("models/<str:name>/predictions/export", feedback.PredictionExportView.as_view()),
    path("models/<str:name>/quality", feedback.QualityView.as_view()),
    path("models/<str:name>/generations", generations.GenerationListView.as_view()),
    # Drift: a version's reference sample and the model's reports.
    path("models/<str:name>/versions/<int:version>/reference", drift.ReferenceView.as_view()),
    path("models/<str:name>/drift", drift.DriftReportListView.as_view()),
    # Alerts and where they are posted.
    path("alerts", alerts.AlertListView.as_view()),
    path("alerts/<int:alert_id>", alerts.AlertDetailView.as_view()),
    path("alerts/<int:alert_id>/resolve", alerts.AlertResolveView.as_view()),
    path("alert-settings", alerts.AlertSettingsView.as_view()),
    # Usage and chargeback, prices, the monthly budget.
    path("usage", usage.UsageView.as_view()),
    path("usage/export", usage.UsageExportView.as_view()),
    path("usage/prices", usage.PricesView.as_view()),
    path("budget", usage.BudgetView.as_view()),
    path("budget/override", usage.BudgetOverrideView.as_view()),
]
