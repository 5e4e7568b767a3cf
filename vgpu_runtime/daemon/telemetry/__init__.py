"""What the daemon reports: status rows, Prometheus /metrics and MQTT."""
