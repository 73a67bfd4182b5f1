"""LMSP wire objects: task states, errors, response objects and events, built in one place."""
