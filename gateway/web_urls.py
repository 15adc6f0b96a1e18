from django.urls import path

from . import web

urlpatterns = [path("", web.home, name="home")]
