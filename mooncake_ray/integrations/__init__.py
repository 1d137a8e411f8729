"""Integrations of mooncake-ray with other frameworks (each imported on demand)."""
