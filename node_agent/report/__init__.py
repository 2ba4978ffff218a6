"""Report writers: JSON (the record), terminal table (for people at a shell)."""
