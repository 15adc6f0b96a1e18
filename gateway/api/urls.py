from django.urls import path

from . import views
from .predict_app import PREDICT, PREDICT_VERSION

# POST to these is served before Django by predict_app (platform_site/asgi.py), which resolves
# the path against these patterns and serves the ones named PREDICT_URL_NAMES.
urlpatterns = [
    path("models/<str:name>/predict", views.PredictView.as_view(), name=PREDICT),
    path(
        # A version number or an alias name (the same rule as OIP's /versions/{v}).
        "models/<str:name>/versions/<str:version>/predict",
        views.PredictView.as_view(),
        name=PREDICT_VERSION,
    ),
]
