"""The web UI: pages rendered from the domain apps' read functions, and the live socket. Every
change a page makes goes through the REST API from its JavaScript: the UI has no second write
path."""
