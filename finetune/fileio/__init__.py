"""Writing and hashing files so that a crash never leaves half of one (atomic.py): the one
home of write_atomic and sha256_of, which everything that writes a file imports. Imports
only errors."""
