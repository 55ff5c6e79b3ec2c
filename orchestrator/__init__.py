"""The orchestrator: speculation loops, local service processes, the HTTP front, the Ray app."""
