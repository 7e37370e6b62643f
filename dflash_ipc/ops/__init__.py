"""Operations: status snapshot views, metrics exposition, systemd integration."""
