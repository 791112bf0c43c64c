"""The LMCache device plugin backed by the kvactors runtime."""
