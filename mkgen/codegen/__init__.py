"""Code generation: render a plan's layout through templates/ into a generated build."""
