"""Constrained decoding: grammars (JSON schema, regex, EBNF) compiled off the engine loop and cached per spec, and
one matcher per request that gives the next token's vocabulary mask and follows the tokens sampled."""
