"""Measurement: peak-memory tracking, timing, roofline, benchmark result files."""
