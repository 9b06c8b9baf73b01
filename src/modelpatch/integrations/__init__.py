"""Integrations with other libraries that wrap or rewrite models (PEFT); each imports its library lazily."""
