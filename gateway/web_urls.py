from django.contrib.auth import views as auth_views
from django.urls import path

from . import web, web_monitoring, web_predictions

urlpatterns = [
    path("", web.home, name="home"),
    path(
        "login/",
        auth_views.LoginView.as_view(template_name="login.html", redirect_authenticated_user=True),
        name="login",
    ),
    path("logout/", auth_views.LogoutView.as_view(next_page="/login/"), name="logout"),
    path("tenant/", web.switch_tenant, name="switch-tenant"),
    path("models/<str:name>/", web.model_detail, name="model"),
    path("models/<str:name>/playground/", web.playground, name="playground"),
    path("rollouts/<int:plan_id>/", web.rollout_detail, name="rollout"),
    path("fleet/", web.fleet, name="fleet"),
    path("approvals/", web.approvals, name="approvals"),
    path("approvals/<int:approval_id>/", web.approval_detail, name="approval"),
    path("audit/", web.audit, name="audit"),
]

# The prediction log and online quality of a model (gateway.web_predictions).
urlpatterns += [
    path("models/<str:name>/predictions/", web_predictions.model_predictions, name="predictions"),
]

# Drift, SLOs and alerts (gateway.web_monitoring).
urlpatterns += [
    path("models/<str:name>/drift/", web_monitoring.drift, name="drift"),
    path("models/<str:name>/drift/data/", web_monitoring.drift_data, name="drift-data"),
    path("slo/", web_monitoring.slo, name="slo"),
    path("slo/data/", web_monitoring.slo_data, name="slo-data"),
    path("alerts/", web_monitoring.alerts, name="alerts"),
]
