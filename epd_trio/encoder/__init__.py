"""The encoder server: request scopes and registry, service, HTTP app, health."""
