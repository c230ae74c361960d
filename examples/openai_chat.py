"""Chat with a running hydra-trio server (./dev.sh run) through the official openai client."""

from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8080/v1", api_key="sk-no-key-required")
reply = client.chat.completions.create(
    model="smollm2-135m",
    messages=[
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What is the capital of France? Answer in one word."},
    ],
    temperature=0,
    max_tokens=32,
)
print(reply.choices[0].message.content)
for chunk in client.chat.completions.create(
    model="smollm2-135m", messages=[{"role": "user", "content": "Count to five."}], max_tokens=32, stream=True
):
    if chunk.choices:
        print(chunk.choices[0].delta.content or "", end="", flush=True)
print()
