"""Tests of the shared floor."""
