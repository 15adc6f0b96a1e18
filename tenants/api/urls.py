from django.urls import path, re_path

from . import views

urlpatterns = [
    path("audit", views.AuditView.as_view()),
    path("audit/export", views.AuditExportView.as_view()),
    re_path(r"^keys/?$", views.KeyListView.as_view()),  # as the issue wrote it, or bare
    path("keys/<int:key_id>/revoke", views.KeyRevokeView.as_view()),
    path("keys/<int:key_id>/rotate", views.KeyRotateView.as_view()),
]
