from django.urls import path

from . import views

urlpatterns = [
    path("models", views.ModelListView.as_view()),
    path("models/<str:name>/versions", views.VersionListView.as_view()),
    path("models/<str:name>/versions/<int:version>", views.VersionDetailView.as_view()),
    path("models/<str:name>/versions/<int:version>/quantize", views.QuantizeView.as_view()),
    path("models/<str:name>/versions/<int:version>/package", views.PackageView.as_view()),
    path("models/<str:name>/aliases/<str:alias>/history", views.AliasHistoryView.as_view()),
]
