"""prorl-sandbox: a standalone runtime server that runs agent tools in persistent PTY shells inside rootless
sandboxes (bubblewrap, Apptainer/Singularity), over HTTP. It knows nothing about RL."""

__version__ = "0.1.0"
