"""The hook specifications, the plugin manager and the calls of the hooks."""
