"""Fakes, fixtures and builders the tests share: real loopback servers, byte-exact wire formats."""
