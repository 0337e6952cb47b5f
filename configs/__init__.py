"""Build configs and GPU architecture profiles shipped with trtc."""
