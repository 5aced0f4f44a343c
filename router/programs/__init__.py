"""Agent programs: a session's turns and the tool calls between them, as the router sees them."""
