"""Engine adapters: the model rendered into what runs on a server (sing-box first)."""
