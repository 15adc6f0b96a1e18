from django.urls import path

from . import views

urlpatterns = [
    path("jobs", views.JobListView.as_view()),
    path("jobs/<int:job_id>", views.JobDetailView.as_view()),
    path("jobs/<int:job_id>/pause", views.JobActionView.as_view(action_name="pause")),
    path("jobs/<int:job_id>/resume", views.JobActionView.as_view(action_name="resume")),
    path("jobs/<int:job_id>/cancel", views.JobActionView.as_view(action_name="cancel")),
    path("jobs/<int:job_id>/output", views.JobOutputView.as_view()),
    path("jobs/<int:job_id>/errors", views.JobErrorsView.as_view()),
]
