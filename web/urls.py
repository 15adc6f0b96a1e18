from django.conf import settings
from django.contrib.auth import views as auth_views
from django.urls import path

from . import (
    alias_views,
    generation_views,
    jobs_views,
    keys_views,
    monitoring_views,
    prediction_views,
    rightsizing_views,
    usage_views,
    version_views,
    views,
)

urlpatterns = [
    path("", views.home, name="home"),
    path(
        "login/",
        auth_views.LoginView.as_view(
            template_name="login.html",
            redirect_authenticated_user=True,
            extra_context={"sso_enabled": settings.SSO_ENABLED},
        ),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(next_page="/login/"), name="logout"),
    path("tenant/", views.switch_tenant, name="switch-tenant"),
    path("models/<str:name>/", views.model_detail, name="model"),
    path("models/<str:name>/playground/", views.playground, name="playground"),
    path("rollouts/<int:plan_id>/", views.rollout_detail, name="rollout"),
    path("fleet/", views.fleet, name="fleet"),
    path("approvals/", views.approvals, name="approvals"),
    path("approvals/<int:approval_id>/", views.approval_detail, name="approval"),
    path("audit/", views.audit, name="audit"),
]

# The prediction log and online quality of a model (web.prediction_views).
urlpatterns += [
    path("models/<str:name>/predictions/", prediction_views.model_predictions, name="predictions"),
    path(
        "models/<str:name>/predictions/export/",
        prediction_views.export_predictions,
        name="predictions-export",
    ),
    path("models/<str:name>/generations/", generation_views.model_generations, name="generations"),
    path(
        "models/<str:name>/generations/export/",
        generation_views.export,
        name="generations-export",
    ),
]

# Right-sizing: measured use and recommendations (web.rightsizing_views).
urlpatterns += [
    path(
        "models/<str:name>/rightsizing/",
        rightsizing_views.model_rightsizing,
        name="rightsizing",
    ),
]

# Drift, SLOs and alerts (web.monitoring_views).
urlpatterns += [
    path("models/<str:name>/drift/", monitoring_views.drift, name="drift"),
    path("models/<str:name>/drift/data/", monitoring_views.drift_data, name="drift-data"),
    path("slo/", monitoring_views.slo, name="slo"),
    path("slo/data/", monitoring_views.slo_data, name="slo-data"),
    path("alerts/", monitoring_views.alerts, name="alerts"),
]

# A version's page: its package (python versions) and its state on the agents
# (web.version_views).
urlpatterns += [
    path(
        "models/<str:name>/versions/<int:version>/",
        version_views.version_detail,
        name="version",
    ),
]

# An alias's history and its break-glass rollback (web.alias_views).
urlpatterns += [
    path("models/<str:name>/aliases/<str:alias>/", alias_views.alias_detail, name="alias"),
]

# Self-service forms (web.selfservice); the version upload goes to the REST API directly.
urlpatterns += [
    path("models/", views.create_model, name="create-model"),
    path(
        "models/<str:name>/drift/reference/",
        monitoring_views.set_drift_reference,
        name="drift-reference",
    ),
]

# API keys (web.keys_views).
urlpatterns += [
    path("keys/", keys_views.keys, name="keys"),
    path("keys/create/", keys_views.create_key, name="key-create"),
    path("keys/<int:key_id>/revoke/", keys_views.revoke_key, name="key-revoke"),
    path("keys/<int:key_id>/rotate/", keys_views.rotate_key, name="key-rotate"),
]

# Usage, cost and the monthly budget (web.usage_views).
urlpatterns += [
    path("usage/", usage_views.usage_page, name="usage"),
    path("usage/override/", usage_views.override_budget, name="budget-override"),
]

# Batch jobs (web.jobs_views).
urlpatterns += [
    path("jobs/", jobs_views.jobs_list, name="jobs"),
    path("jobs/<int:job_id>/", jobs_views.job_detail, name="job"),
    path("jobs/<int:job_id>/status/", jobs_views.job_status, name="job-status"),
    path("jobs/<int:job_id>/output/", jobs_views.job_output, name="job-output"),
    path("jobs/<int:job_id>/<str:action>/", jobs_views.job_action, name="job-action"),
]
