"""Decides: what to run, where, and which configuration was best."""
