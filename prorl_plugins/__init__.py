"""Swappable parts (training-backend hooks, staleness control, reward shaping), installed as `prorl_plugins`."""
