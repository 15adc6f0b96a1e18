from django.urls import path

from . import views

urlpatterns = [
    path("models/<str:name>/predict", views.PredictView.as_view()),
    path("models/<str:name>/versions/<int:version>/predict", views.PredictView.as_view()),
]
