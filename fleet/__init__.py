"""Where versions run: nodes and their agents' sessions, what each agent is assigned, pools and
deployments, the autoscaler and cold starts, and the cluster backends that start replicas."""
