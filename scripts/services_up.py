"""Exit 0 when the PostgreSQL at DATABASE_URL and the Redis at REDIS_URL both answer."""

import os
import sys

import psycopg
import redis

try:
    url = os.environ["DATABASE_URL"].replace("postgres://", "postgresql://", 1)
    psycopg.connect(url, connect_timeout=3).close()
    redis.Redis.from_url(os.environ["REDIS_URL"], socket_connect_timeout=3).ping()
except Exception as exc:  # any failure means "not reachable"
    print(f"services not reachable: {exc}", file=sys.stderr)
    sys.exit(1)
