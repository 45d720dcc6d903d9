"""Comparing a candidate trace with its reference: plan, per-tensor verdict, thresholds, localisation."""
