"""Diagnostics that look inside kvjax (see README.md)."""
