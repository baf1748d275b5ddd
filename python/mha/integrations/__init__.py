"""Plug-ins for other libraries: `import mha.integrations.transformers` registers mha as the
attention implementation "mha" of Hugging Face transformers."""
