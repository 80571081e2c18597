//! Chat prompts from the model's own Jinja template (`tokenizer.chat_template`), rendered with
//! minijinja the way Hugging Face and llama.cpp's Jinja mode do; ChatML when there is none.

use minijinja::{context, Environment, Error, ErrorKind};

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Self { role: role.into(), content: content.into() }
    }
}

const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// Renders `messages` with `template` (or ChatML), ending with the assistant's turn opened.
pub fn render(template: Option<&str>, messages: &[Message], bos: &str, eos: &str) -> Result<String, Error> {
    render_with(template, messages, bos, eos, true)
}

/// Renders `messages`; `add_generation_prompt` opens the assistant's turn at the end.
pub fn render_with(
    template: Option<&str>,
    messages: &[Message],
    bos: &str,
    eos: &str,
    add_generation_prompt: bool,
) -> Result<String, Error> {
    let mut env = Environment::new();
    env.add_function("raise_exception", |msg: String| -> Result<String, Error> { Err(Error::new(ErrorKind::InvalidOperation, msg)) });
    env.add_template("chat", template.unwrap_or(CHATML))?;
    let msgs: Vec<_> = messages.iter().map(|m| context! { role => m.role, content => m.content }).collect();
    env.get_template("chat")?
        .render(context! { messages => msgs, add_generation_prompt => add_generation_prompt, bos_token => bos, eos_token => eos })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_default_and_bad_template_is_an_error() {
        let s = render(None, &[Message::new("user", "hi")], "", "").unwrap();
        assert_eq!(s, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n");
        assert!(render(Some("{% for %}"), &[], "", "").is_err());
    }
}
