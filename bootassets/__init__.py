"""What machines boot: the discovery image (Debian kernel + small initramfs + agent) and iPXE."""
