"""Ray Serve application: OpenAI routes, async engine loop, session-affinity router."""
