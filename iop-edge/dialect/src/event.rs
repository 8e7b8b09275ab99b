//! The event model responses are translated through.

/// One step of a model's response, whatever dialect it came in.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// The response started (the encoder emits its opening events; it also does so lazily on
    /// the first other event, so this is optional).
    Start,
    /// Assistant text.
    Text(String),
    /// A tool call begins. `index` counts calls from 0 in the order they started.
    ToolCallStart {
        /// The call's ordinal.
        index: u32,
        /// The provider's call id (`call_…`, `toolu_…`).
        id: String,
        /// The function's name.
        name: String,
    },
    /// A fragment of a tool call's JSON arguments.
    ToolCallArguments {
        /// The call's ordinal.
        index: u32,
        /// The fragment.
        delta: String,
    },
    /// Token counts; a field the upstream did not say is `None` and leaves the last value.
    Usage(Usage),
    /// Why the model stopped.
    Finish(FinishReason),
    /// The upstream failed mid-stream; the stream ends with the dialect's error event.
    Error(String),
}

/// Token counts of a response.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Usage {
    /// Prompt (input) tokens.
    pub input_tokens: Option<u64>,
    /// Completion (output) tokens.
    pub output_tokens: Option<u64>,
}

impl Usage {
    /// Takes the fields `newer` says.
    pub fn merge(&mut self, newer: Self) {
        if newer.input_tokens.is_some() {
            self.input_tokens = newer.input_tokens;
        }
        if newer.output_tokens.is_some() {
            self.output_tokens = newer.output_tokens;
        }
    }

    /// Input tokens, 0 when unknown.
    pub fn input(&self) -> u64 {
        self.input_tokens.unwrap_or(0)
    }

    /// Output tokens, 0 when unknown.
    pub fn output(&self) -> u64 {
        self.output_tokens.unwrap_or(0)
    }

    /// Whether any count is known.
    pub fn is_known(&self) -> bool {
        self.input_tokens.is_some() || self.output_tokens.is_some()
    }
}

/// Why a model stopped, across dialects.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum FinishReason {
    /// A natural end (chat `stop`, Anthropic `end_turn`).
    #[default]
    Stop,
    /// One of the request's stop sequences (Anthropic `stop_sequence`; chat `stop`).
    StopSequence(Option<String>),
    /// The token limit (chat `length`, Anthropic `max_tokens`).
    Length,
    /// The model called tools (chat `tool_calls`, Anthropic `tool_use`).
    ToolCalls,
    /// Content was filtered or refused (chat `content_filter`, Anthropic `refusal`).
    ContentFilter,
}

impl FinishReason {
    /// From a chat `finish_reason`.
    pub fn from_chat(s: &str) -> Self {
        match s {
            "length" => Self::Length,
            "tool_calls" | "function_call" => Self::ToolCalls,
            "content_filter" => Self::ContentFilter,
            _ => Self::Stop,
        }
    }

    /// A chat `finish_reason`.
    pub fn chat(&self) -> &'static str {
        match self {
            Self::Stop | Self::StopSequence(_) => "stop",
            Self::Length => "length",
            Self::ToolCalls => "tool_calls",
            Self::ContentFilter => "content_filter",
        }
    }

    /// From an Anthropic `stop_reason` (and `stop_sequence`).
    pub fn from_anthropic(s: &str, sequence: Option<&str>) -> Self {
        match s {
            "max_tokens" | "model_context_window_exceeded" => Self::Length,
            "tool_use" => Self::ToolCalls,
            "refusal" => Self::ContentFilter,
            "stop_sequence" => Self::StopSequence(sequence.map(str::to_owned)),
            _ => Self::Stop,
        }
    }

    /// An Anthropic `stop_reason`.
    pub fn anthropic(&self) -> &'static str {
        match self {
            Self::Stop => "end_turn",
            Self::StopSequence(_) => "stop_sequence",
            Self::Length => "max_tokens",
            Self::ToolCalls => "tool_use",
            Self::ContentFilter => "refusal",
        }
    }

    /// The Responses API `incomplete_details.reason`, when the response is incomplete.
    pub fn responses_incomplete(&self) -> Option<&'static str> {
        match self {
            Self::Length => Some("max_output_tokens"),
            Self::ContentFilter => Some("content_filter"),
            _ => None,
        }
    }
}

/// One complete tool call.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ToolCall {
    /// The provider's call id.
    pub id: String,
    /// The function's name.
    pub name: String,
    /// The JSON arguments, as text.
    pub arguments: String,
}

/// A whole (non-streamed) response, or a stream folded with [`Message::apply`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Message {
    /// The assistant text.
    pub text: String,
    /// The tool calls, in order.
    pub tool_calls: Vec<ToolCall>,
    /// Why the model stopped; `None` when the upstream did not say.
    pub finish: Option<FinishReason>,
    /// Token counts.
    pub usage: Usage,
    /// A mid-stream failure, if one ended the stream.
    pub error: Option<String>,
}

impl Message {
    /// Folds one event in.
    pub fn apply(&mut self, event: &Event) {
        match event {
            Event::Start => {}
            Event::Text(t) => self.text.push_str(t),
            Event::ToolCallStart { index, id, name } => {
                let i = *index as usize;
                if self.tool_calls.len() <= i {
                    self.tool_calls.resize_with(i + 1, ToolCall::default);
                }
                self.tool_calls[i].id.clone_from(id);
                self.tool_calls[i].name.clone_from(name);
            }
            Event::ToolCallArguments { index, delta } => {
                if let Some(c) = self.tool_calls.get_mut(*index as usize) {
                    c.arguments.push_str(delta);
                }
            }
            Event::Usage(u) => self.usage.merge(*u),
            Event::Finish(r) => self.finish = Some(r.clone()),
            Event::Error(e) => self.error = Some(e.clone()),
        }
    }

    /// The finish reason, inferring `ToolCalls` when the upstream said nothing but called tools.
    pub fn finish_reason(&self) -> FinishReason {
        match &self.finish {
            Some(r) => r.clone(),
            None if !self.tool_calls.is_empty() => FinishReason::ToolCalls,
            None => FinishReason::Stop,
        }
    }

    /// The events that stream this message (for a client that asked for a stream from an
    /// upstream that answered with one JSON body).
    pub fn events(&self) -> Vec<Event> {
        let mut out = vec![Event::Start];
        if !self.text.is_empty() {
            out.push(Event::Text(self.text.clone()));
        }
        for (i, c) in self.tool_calls.iter().enumerate() {
            let index = u32::try_from(i).unwrap_or(u32::MAX);
            out.push(Event::ToolCallStart {
                index,
                id: c.id.clone(),
                name: c.name.clone(),
            });
            if !c.arguments.is_empty() {
                out.push(Event::ToolCallArguments {
                    index,
                    delta: c.arguments.clone(),
                });
            }
        }
        if self.usage.is_known() {
            out.push(Event::Usage(self.usage));
        }
        out.push(Event::Finish(self.finish_reason()));
        out
    }
}

/// What the client's response says about itself: the id and model the client sees (the Edge's
/// run id and the external model name, not the upstream's), and the creation time.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Meta {
    /// The response id as the client sees it (`chatcmpl-…`, `resp_…`, `msg_…`); item ids are
    /// derived from it.
    pub id: String,
    /// The model name the client asked for.
    pub model: String,
    /// Creation time, Unix seconds.
    pub created: u64,
}
