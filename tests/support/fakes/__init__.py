"""Fakes several tests share (a fake one test module uses stays in it): a servicer context
that aborts (context), a channel that opens nothing (channel), a stand-in Kubernetes API
server (apiserver)."""
