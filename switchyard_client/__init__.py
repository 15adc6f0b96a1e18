"""Switchyard's Python SDK and the `switchyard` command line: a client of the platform's HTTP
APIs (REST, OIP v2 and the generation websocket) that needs no platform code and no Django."""
