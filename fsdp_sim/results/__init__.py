"""Figures from a simulated step, and the exporters that turn them into JSON, traces, CSV and text."""
