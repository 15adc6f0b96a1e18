"""Rollout plans (canary, shadow, A/B), sticky traffic routing and the audit log."""
