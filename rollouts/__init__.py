"""Rollout plans, approvals and guardrails (canary, shadow, A/B): not built yet."""
