"""Replaying the failing step with fixes applied, and ranking what they measurably did."""
