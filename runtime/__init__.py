"""trtc runtime: what loads an artifact and runs it."""
