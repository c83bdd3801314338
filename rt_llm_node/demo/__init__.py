"""The demo: a 2D differential-drive world, its scripted expert, and the shipped policy."""
