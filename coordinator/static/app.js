// duplexq browser demo: microphone (and camera) in, speech out, barge-in.
//
// The page speaks the Realtime protocol of /v1/realtime:
//   mic  -> AudioWorklet (ScriptProcessor fallback) -> 24 kHz mono PCM16
//        -> input_audio_buffer.append every 40 ms
//   cam  -> one JPEG a second -> duplexq.input_video.append
//   response.output_audio.delta -> Web Audio buffers scheduled back to back
//
// Interruptions silence playback at once: every scheduled source is stopped
// and disconnected and queued audio is dropped, on a local Interrupt (which
// also sends duplexq.barge_in), on input_audio_buffer.speech_started, on
// duplexq.response.cancelled and on response.done with status "cancelled". Audio of an
// interrupted response that still arrives is dropped by its response id and by
// its fence epoch (every server event carries the fence it was produced
// under), so nothing of it is heard. When a response's playback ends
// (completed or cut) the page sends duplexq.playback.ack with how much was heard.
// The reason of a stop is "interrupt", "speech_started", "cancelled" (either
// server event) or "disconnected".
//
// Authentication: the page never puts a key in a URL. The API key typed into the
// page (kept in sessionStorage, so for this tab only) is sent once per connect as
// `Authorization: Bearer` to POST /v1/realtime/client_secrets, which answers a
// short-lived client secret; the WebSocket presents that secret as the subprotocol
// `openai-insecure-api-key.<secret>` beside `realtime`. Where the server allows
// anonymous clients the key may stay empty.
//
// Each message shows once: the user's typed text when sent, their speech when
// transcribed; an answer's text from its text deltas, or from its audio
// transcript when it has no text. An answer cut by an interruption is marked
// where it was cut.
//
// Models: each stage worker loads its model when it starts and only then counts as
// ready. The page reads GET /v1/stages when it opens (and every STAGES_POLL_MS while
// some stage is not ready, and on connect): until every stage is ready it shows which
// are loading, and a turn that ends meanwhile is shown as waiting for them ("loading
// the models (…)…") rather than as thinking. A stage that serves the random-weight
// fallback model (its own model missing) gets a notice: its answers are gibberish,
// and the notice says how to fix it.
//
// Tools: with "Offer a tool" checked the session declares get_current_time; when
// the model calls it the page runs it, shows the call and its result, and sends
// the result back (function_call_output, then response.create).
//
// Status: what is happening now. "thinking…" (or "loading the models…") from a turn's
// end until its answer arrives; "answering" while an answer streams and nothing plays;
// "speaking" from when its audio begins to sound until what is queued has played;
// "hearing you…" while the server hears the user speak. When playback ends the status
// says "answering" if the answer still streams, else it rests ("listening" with the
// microphone on), as it does when the answer ends or is interrupted (locally or by
// the server).
//
// Trace: while tracing is on, the server sends duplexq.turn.trace once a turn's answer
// begins; the Latency pane then draws that turn's waterfall (waterfall.js).
//
// window.duplexqDemo exposes the page's state for tests and for the curious.

import { Player } from "./player.js";
import { renderWaterfall } from "./waterfall.js";
import { Resampler, base64ToBytes, bytesToBase64, floatToPcm16, pcm16ToFloat } from "./pcm.js";

const INPUT_RATE = 24000;
const FRAME_SAMPLES = (INPUT_RATE * 40) / 1000; // 40 ms per append
const TICK_MS = 20;
const MAX_EVENTS = 2000;
const FRAME_INTERVAL_MS = 1000;
const MAX_FRAME_WIDTH = 640;
const VOICE_RMS = 0.02; // mic level above which the user is taken to be speaking
const VOICE_QUIET_MS = 300; // quiet needed before a new voice onset
const VOICE_WINDOW_MS = 5000; // an onset older than this did not cause a barge-in
const SILENT_RMS = 1e-4; // output level below which playback counts as silent
const KEY_STORAGE = "duplexq.apiKey"; // sessionStorage: this tab only, gone when it closes
const SECRET_TTL_S = 60; // the client secret only has to last until the socket opens
const STAGES_POLL_MS = 2000; // how often the page asks /v1/stages while models load
const STATUS_LOG = 200; // status changes kept in the state, newest last
const ANSWER_STATUSES = new Set(["speaking", "answering"]); // an answer under way

// -- the page ------------------------------------------------------------------------

const $ = (id) => document.getElementById(id);

function newState() {
  return {
    connected: false,
    sessionId: null,
    resumeToken: null,
    status: "disconnected",
    statusLog: [], // {status, playing, speaking, at}: the last STATUS_LOG status changes
    events: [], // server event types, oldest first (the last MAX_EVENTS)
    eventCounts: {},
    sent: {}, // client event types sent, counted
    transcript: "", // the user's transcribed utterances, one a line
    assistantText: "", // text and audio transcript of every response
    audioChunksReceived: 0,
    audioChunksPlayed: 0, // chunks whose playback began
    audioChunksDropped: 0, // chunks of interrupted responses, never played
    playing: false, // audio is sounding or scheduled
    speaking: false, // an answer's audio began to sound and what is queued has not played out
    outputLevel: 0, // RMS of the audio being played, read every tick
    lastStopReason: null,
    stops: [], // {reason, responseIds, cutChunks, at}
    acks: [], // duplexq.playback.ack sent
    calls: [], // {call_id, name, arguments, result}: function calls the page ran
    answered: false, // a response delta arrived in this session (the models are loaded)
    responses: {}, // id -> per-response playback record
    latencies: {
      firstDeltaMs: null, // turn end -> first response delta (latest turn)
      firstAudioMs: null, // turn end -> first response audio (latest turn)
      bargeInSilenceMs: null, // trigger -> output measured silent (latest)
      bargeInCancelledMs: null, // trigger -> duplexq.response.cancelled (latest)
      bargeInVoiceMs: null, // the user's voice (mic level) -> silence (latest server barge-in)
      turns: [],
      bargeIns: [],
    },
    lastTurnTrace: null, // the latest duplexq.turn.trace (tracing on)
    errors: [],
    micSampleRate: null,
    micFramesSent: 0,
    videoFramesSent: 0,
    ...readiness(null),
  };
}

/** What the page knows of the stages' models, from a /v1/stages body (null: unknown). */
function readiness(body) {
  // With Redis unreachable the server cannot tell: unknown, asked again later.
  if (!body || !body.redis) return { stages: null, loading: null, fallback: [] };
  const stages = body.stages || [];
  return {
    stages,
    loading: stages.filter((s) => !s.ready).map((s) => s.name),
    fallback: stages.filter((s) => s.models.some((m) => m.fallback)).map((s) => s.name),
  };
}

class Demo {
  constructor() {
    this.state = newState();
    window.duplexqDemo = this.state;
    this.ws = null;
    this.ctx = null;
    this.player = null;
    this.mic = null; // {stream, nodes, resampler, pending}
    this.camera = null; // {stream, timer, canvas}
    this.epoch = 0; // highest fence epoch seen
    this.minEpoch = 0; // audio of older epochs is stale
    this.stopped = new Set(); // response ids whose playback was cut
    this.heardItems = new Set(); // the user's items already shown
    this.speechStage = null; // the stage whose speech events this page follows
    this.pendingTurn = null; // {trigger, at, firstDelta, firstAudio}
    this.pendingBargeIn = null;
    this.awaitingSilence = null; // the barge-in whose silence the meter has yet to see
    this.voiceOnsetAt = null; // when the mic level last rose after a quiet spell
    this.quietSince = null;
    this.openedAt = 0;
    this.timer = null;
    this.connecting = false;
    this.resting = "disconnected"; // the status when nothing is heard, thought or played
    this.turnAt = 0; // when the latest turn ended
    this.models = readiness(null); // kept across connections (state is per connection)
    this.stagesTimer = null;
    this.bind();
    this.watchStages();
  }

  bind() {
    $("api-key").value = sessionStorage.getItem(KEY_STORAGE) || "";
    $("connect").addEventListener("click", () => {
      if (this.connecting) return;
      if (this.ws) this.disconnect();
      else this.connect().finally(() => (this.connecting = false));
    });
    $("interrupt").addEventListener("click", () => this.interrupt());
    $("camera").addEventListener("change", (e) => {
      if (e.target.checked) this.startCamera();
      else this.stopCamera();
    });
    $("text-form").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("text").value.trim();
      if (text) this.sendText(text);
      $("text").value = "";
    });
  }

  setStatus(text) {
    if (text === this.state.status) return;
    const state = this.state;
    state.status = text;
    const { playing, speaking } = state;
    state.statusLog.push({ status: text, playing, speaking, at: performance.now() });
    if (state.statusLog.length > STATUS_LOG) state.statusLog.shift();
    $("status").textContent = text;
  }

  /** The resting status, now that nothing is heard, thought or played. */
  rest() {
    this.setStatus(this.resting);
  }

  /** Rest if the status still says the connection is being set up. */
  restIfConnecting() {
    const status = this.state.status;
    if (status === "connecting…" || status.startsWith("session ")) this.rest();
  }

  /** Rest if the status spoke of an answer that is no longer under way. */
  settle() {
    if (ANSWER_STATUSES.has(this.state.status)) this.rest();
  }

  // -- the stages' models --------------------------------------------------------------

  /** Read /v1/stages now, and again every STAGES_POLL_MS until every stage is ready. */
  async watchStages() {
    clearTimeout(this.stagesTimer);
    let body = null;
    try {
      const response = await fetch("/v1/stages", { cache: "no-store" });
      if (response.ok) body = await response.json();
    } catch {
      body = null; // unknown, not "ready": asked again below
    }
    this.showModels(readiness(body));
    if (!body || !body.ready) this.stagesTimer = setTimeout(() => this.watchStages(), STAGES_POLL_MS);
  }

  showModels(models) {
    const wasLoading = this.models.loading && this.models.loading.length > 0;
    this.models = models;
    Object.assign(this.state, models);
    const loading = models.loading || [];
    $("models").hidden = loading.length === 0;
    $("models").textContent = `Loading the models of: ${loading.join(", ")}. A turn waits for them.`;
    const notice = $("fallback");
    notice.hidden = models.fallback.length === 0;
    if (!notice.hidden) {
      const lines = models.stages
        .filter((s) => models.fallback.includes(s.name))
        .map((s) => {
          const wanted = s.models.filter((m) => m.fallback).map((m) => m.model).join(", ");
          return `${s.name} (its model ${wanted} is not available on the server)`;
        });
      notice.textContent =
        `Answers will be gibberish: ${lines.join("; ")} serves a tiny random-weight ` +
        "fallback model. To fix it, run scripts/setup on the server (it prepares the " +
        "default model) or set the stage's model to one the server has, then restart " +
        "(docs/models.md).";
    }
    if (wasLoading && loading.length === 0 && this.state.status.startsWith("loading")) {
      this.setStatus("thinking…");
    }
  }

  // -- connection ------------------------------------------------------------------

  async connect() {
    this.connecting = true;
    this.state = newState();
    window.duplexqDemo = this.state;
    this.epoch = 0;
    this.minEpoch = 0;
    this.stopped.clear();
    this.heardItems.clear();
    this.speechStage = null;
    this.pendingTurn = null;
    this.pendingBargeIn = null;
    this.awaitingSilence = null;
    this.voiceOnsetAt = null;
    this.quietSince = null;
    for (const id of ["user-transcript", "assistant-text"]) $(id).replaceChildren();
    Object.assign(this.state, this.models);
    this.watchStages();
    this.resting = "connecting…";
    this.setStatus("connecting…");
    $("connect").textContent = "Disconnect";

    this.ctx = new AudioContext({ latencyHint: "interactive" });
    await this.ctx.resume();
    this.player = new Player(this.ctx);

    let secret;
    try {
      secret = await this.clientSecret();
    } catch (err) {
      this.state.errors.push({ code: err.code || "client_secret", message: String(err.message || err) });
      this.onClosed(null, { code: 0, reason: "" }, `could not connect: ${err.message || err}`);
      return;
    }
    const url = new URL("/v1/realtime", location.href);
    url.protocol = location.protocol === "https:" ? "wss:" : "ws:";
    const ws = new WebSocket(url, ["realtime", `openai-insecure-api-key.${secret}`]);
    this.ws = ws;
    ws.onopen = () => {
      this.openedAt = performance.now();
      // Sent first: the server reads it before it announces the session.
      const session = { input_audio_format: "pcm16", input_audio_sample_rate: INPUT_RATE };
      if ($("tool").checked) session.tools = [CURRENT_TIME_TOOL];
      this.send({ type: "session.update", session });
    };
    ws.onmessage = (message) => this.onServerEvent(JSON.parse(message.data));
    ws.onclose = (e) => this.onClosed(ws, e);
    this.timer = setInterval(() => this.tick(), TICK_MS);

    try {
      await this.startMic();
    } catch (err) {
      this.state.errors.push({ code: "microphone", message: String(err) });
      this.resting = `no microphone (${err.name || err}); text only`;
      if (this.ws) this.rest();
    }
    if ($("camera").checked) this.startCamera();
  }

  /** A short-lived client secret, minted with the API key typed into the page. */
  async clientSecret() {
    const key = $("api-key").value.trim();
    if (key) sessionStorage.setItem(KEY_STORAGE, key);
    else sessionStorage.removeItem(KEY_STORAGE);
    const headers = { "Content-Type": "application/json" };
    if (key) headers.Authorization = `Bearer ${key}`;
    const response = await fetch("/v1/realtime/client_secrets", {
      method: "POST",
      headers,
      cache: "no-store",
      body: JSON.stringify({ expires_after: { anchor: "created_at", seconds: SECRET_TTL_S } }),
    });
    const body = await response.json().catch(() => ({}));
    if (!response.ok) {
      const error = body.error || {};
      const hint = response.status === 401 ? "; check the API key" : "";
      const err = new Error(`${response.status} ${error.code || ""}: ${error.message || ""}${hint}`);
      err.code = error.code;
      throw err;
    }
    return body.value;
  }

  disconnect() {
    if (this.ws) this.ws.close(1000, "bye");
  }

  onClosed(ws, event, message = null) {
    if (ws !== this.ws) return;
    this.ws = null;
    this.stopPlayback("disconnected");
    this.stopMic();
    this.stopCamera();
    clearInterval(this.timer);
    this.timer = null;
    if (this.ctx) this.ctx.close();
    this.ctx = null;
    this.player = null;
    this.state.connected = false;
    $("connect").textContent = "Connect";
    for (const id of ["interrupt", "text", "send"]) $(id).disabled = true;
    const why = event.reason ? `${event.code}: ${event.reason}` : `${event.code}`;
    this.setStatus(
      message ||
        (this.state.sessionId ? `disconnected (${why})` : `could not connect (${why}); is the API key right?`),
    );
  }

  send(event) {
    if (!this.ws || this.ws.readyState !== WebSocket.OPEN) return false;
    this.ws.send(JSON.stringify(event));
    this.state.sent[event.type] = (this.state.sent[event.type] || 0) + 1;
    return true;
  }

  // -- input -------------------------------------------------------------------------

  async startMic() {
    const ctx = this.ctx;
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { channelCount: 1, echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    if (this.ctx !== ctx) {
      stream.getTracks().forEach((t) => t.stop()); // disconnected meanwhile
      return;
    }
    const source = ctx.createMediaStreamSource(stream);
    const sink = ctx.createGain(); // keeps the tap pulled by the graph, inaudibly
    sink.gain.value = 0;
    sink.connect(ctx.destination);
    this.mic = {
      stream,
      nodes: [source, sink],
      resampler: new Resampler(ctx.sampleRate, INPUT_RATE),
      pending: new Float32Array(0),
    };
    this.state.micSampleRate = ctx.sampleRate;
    this.quietSince = performance.now();
    let tap;
    if (ctx.audioWorklet && typeof AudioWorkletNode === "function") {
      await ctx.audioWorklet.addModule("/static/capture-worklet.js");
      tap = new AudioWorkletNode(ctx, "duplexq-capture", { numberOfInputs: 1, numberOfOutputs: 1 });
      tap.port.onmessage = (e) => this.onMicBlock(e.data);
    } else {
      tap = ctx.createScriptProcessor(1024, 1, 1);
      tap.onaudioprocess = (e) => this.onMicBlock(e.inputBuffer.getChannelData(0).slice(0));
    }
    if (!this.mic) {
      // disconnected while the worklet loaded
      stream.getTracks().forEach((t) => t.stop());
      return;
    }
    this.mic.nodes.push(tap);
    source.connect(tap);
    tap.connect(sink);
    this.resting = "listening";
    this.restIfConnecting();
  }

  stopMic() {
    if (!this.mic) return;
    this.mic.stream.getTracks().forEach((t) => t.stop());
    for (const node of this.mic.nodes) node.disconnect();
    this.mic = null;
  }

  onMicBlock(block) {
    const mic = this.mic;
    if (!mic) return;
    // Muted: silence keeps flowing, so server VAD still sees time pass.
    const input = $("mute").checked ? new Float32Array(block.length) : block;
    this.trackVoice(input);
    const resampled = mic.resampler.process(input);
    const pending = new Float32Array(mic.pending.length + resampled.length);
    pending.set(mic.pending);
    pending.set(resampled, mic.pending.length);
    let offset = 0;
    for (; offset + FRAME_SAMPLES <= pending.length; offset += FRAME_SAMPLES) {
      const frame = pending.subarray(offset, offset + FRAME_SAMPLES);
      const audio = bytesToBase64(floatToPcm16(frame));
      if (this.send({ type: "input_audio_buffer.append", audio })) this.state.micFramesSent++;
    }
    mic.pending = pending.slice(offset);
  }

  trackVoice(block) {
    let sum = 0;
    for (const s of block) sum += s * s;
    const rms = Math.sqrt(sum / block.length);
    $("mic-level").style.width = `${Math.min(100, rms * 400)}%`;
    const now = performance.now();
    if (rms < VOICE_RMS) {
      if (this.quietSince === null) this.quietSince = now;
    } else {
      if (this.quietSince !== null && now - this.quietSince >= VOICE_QUIET_MS) {
        this.voiceOnsetAt = now;
      }
      this.quietSince = null;
    }
  }

  async startCamera() {
    if (this.camera || !this.ws) return;
    let stream;
    try {
      stream = await navigator.mediaDevices.getUserMedia({ video: { width: 640, height: 480 } });
    } catch (err) {
      this.state.errors.push({ code: "camera", message: String(err) });
      $("camera").checked = false;
      return;
    }
    const video = $("preview");
    video.srcObject = stream;
    video.hidden = false;
    await video.play().catch(() => {});
    const canvas = document.createElement("canvas");
    const timer = setInterval(() => this.sendFrame(video, canvas), FRAME_INTERVAL_MS);
    this.camera = { stream, timer, canvas };
  }

  stopCamera() {
    if (!this.camera) return;
    clearInterval(this.camera.timer);
    this.camera.stream.getTracks().forEach((t) => t.stop());
    const video = $("preview");
    video.srcObject = null;
    video.hidden = true;
    this.camera = null;
  }

  sendFrame(video, canvas) {
    if (!this.state.connected || video.readyState < 2 || !video.videoWidth) return;
    const scale = Math.min(1, MAX_FRAME_WIDTH / video.videoWidth);
    canvas.width = Math.round(video.videoWidth * scale);
    canvas.height = Math.round(video.videoHeight * scale);
    canvas.getContext("2d").drawImage(video, 0, 0, canvas.width, canvas.height);
    const pts = Math.round(performance.now() - this.openedAt);
    canvas.toBlob(
      async (blob) => {
        if (!blob) return;
        const image = bytesToBase64(new Uint8Array(await blob.arrayBuffer()));
        if (this.send({ type: "duplexq.input_video.append", image, pts_ms: pts })) {
          this.state.videoFramesSent++;
        }
      },
      "image/jpeg",
      0.7,
    );
  }

  sendText(text) {
    const sent = this.send({
      type: "conversation.item.create",
      item: { type: "message", role: "user", content: [{ type: "input_text", text }] },
    });
    if (!sent) return;
    this.addUserLine(text);
    this.send({ type: "response.create" });
    this.beginTurn("text");
    this.awaitAnswer();
  }

  /** After a turn ends: the answer waits for the models of the stages still loading. */
  awaitAnswer() {
    const loading = this.models.loading;
    if (loading === null) {
      // Readiness unknown (/v1/stages did not answer): the first answer may wait.
      this.setStatus(this.state.answered ? "thinking…" : "loading the models for the first answer…");
    } else {
      this.setStatus(loading.length ? `loading the models (${loading.join(", ")})…` : "thinking…");
    }
  }

  interrupt() {
    const at = performance.now();
    // duplexq.barge_in goes first so that the duplexq.playback.ack of the cut response (sent by the
    // stop below, in this same task) reaches the session after the interruption.
    this.send({ type: "duplexq.barge_in" });
    this.bargeIn("interrupt", at);
    // Audio produced before the server applies the barge-in is stale.
    this.minEpoch = Math.max(this.minEpoch, this.epoch + 1);
    this.settle();
  }

  /** Whether an answer is still streaming (begun, not ended, not cut). */
  streaming() {
    return Object.values(this.state.responses).some(
      (r) => r.status === "in_progress" && !r.stopped && r.epoch >= this.minEpoch,
    );
  }

  // -- server events ------------------------------------------------------------------

  onServerEvent(event) {
    const state = this.state;
    state.events.push(event.type);
    if (state.events.length > MAX_EVENTS) state.events.splice(0, state.events.length - MAX_EVENTS);
    state.eventCounts[event.type] = (state.eventCounts[event.type] || 0) + 1;
    const fence = own(event).fence;
    if (fence) this.epoch = Math.max(this.epoch, fence.epoch);
    const handler = HANDLERS[event.type];
    if (handler) handler.call(this, event);
  }

  onSessionCreated(event) {
    Object.assign(this.state, {
      connected: true,
      sessionId: event.session.id,
      resumeToken: own(event).resume_token,
    });
    for (const id of ["interrupt", "text", "send"]) $(id).disabled = false;
    if (!this.mic && this.resting === "connecting…") {
      this.resting = `session ${event.session.id}`; // until the microphone is on
      this.restIfConnecting();
    }
  }

  onTurnTrace(event) {
    this.state.lastTurnTrace = event;
    renderWaterfall($("waterfall"), event);
  }

  onError(event) {
    const error = event.error || {};
    this.state.errors.push({ code: error.code, message: error.message });
    this.setStatus(`error: ${error.code}: ${error.message}`);
  }

  onSpeech(event) {
    const stage = own(event).stage;
    this.speechStage = this.speechStage || stage;
    if (stage !== this.speechStage) return; // the same utterance seen by a later stage
    const at = performance.now();
    if (event.type === "input_audio_buffer.speech_started") {
      this.pendingTurn = null;
      this.minEpoch = Math.max(this.minEpoch, own(event).fence.epoch);
      this.bargeIn("speech_started", at);
      this.setStatus("hearing you…");
    } else {
      this.beginTurn("speech_stopped", at);
      this.awaitAnswer();
    }
  }

  onCommitted() {
    if (!this.pendingTurn) this.beginTurn("commit");
  }

  onTranscription(event) {
    // One line per utterance, however many stages report its transcript.
    if (this.heardItems.has(event.item_id)) return;
    this.heardItems.add(event.item_id);
    this.addUserLine(event.transcript);
  }

  onResponseCreated(event) {
    this.response(event.response.id, own(event).fence.epoch).createdAt = performance.now();
    if (this.pendingBargeIn && this.pendingBargeIn.trigger !== "interrupt") {
      this.pendingBargeIn = null; // speech that did not interrupt (no cancel will come)
    }
  }

  onDelta(event) {
    const epoch = own(event).fence.epoch;
    const record = this.response(event.response_id, epoch);
    if (record.cancelSeen) record.receivedAfterCancel++;
    const audio = event.type === "response.output_audio.delta";
    if (audio) {
      this.state.audioChunksReceived++;
      record.received++;
    }
    if (epoch < this.minEpoch || this.stopped.has(event.response_id)) {
      if (audio) {
        this.state.audioChunksDropped++;
        record.dropped++;
      }
      return;
    }
    this.markFirstDelta(audio);
    this.state.answered = true;
    if (audio) {
      this.player.schedule(event.response_id, pcm16ToFloat(base64ToBytes(event.delta)));
      record.scheduled++;
    } else {
      // One text per answer: its text deltas, or its audio transcript when it has none.
      const kind = event.type === "response.output_text.delta" ? "text" : "transcript";
      record.shown = record.shown || kind;
      if (record.shown === kind) this.addAssistantText(event.response_id, event.delta);
    }
    // "speaking" comes when its audio sounds (tick).
    if (this.state.status.startsWith("loading") || this.state.status === "thinking…") {
      this.setStatus("answering");
    }
  }

  /** The model called a function: run it, show it, and give the result back. */
  onFunctionCall(event) {
    const tool = TOOLS[event.name];
    let args = {};
    try {
      args = JSON.parse(event.arguments || "{}");
    } catch {
      args = {};
    }
    const result = tool ? tool(args) : `no function named ${event.name}`;
    this.state.calls.push({ call_id: event.call_id, name: event.name, arguments: event.arguments, result });
    this.addCallLine(`${event.name}(${event.arguments || ""}) → ${result}`);
    // Given back once the response that made the call is done: a response.create while
    // a response is in progress is refused (conversation_already_has_active_response).
    this.results = [...(this.results || []), { call_id: event.call_id, output: result }];
  }

  onResponseDone(event) {
    const record = this.response(event.response.id, own(event).fence.epoch);
    record.status = event.response.status;
    if (record.status === "cancelled") this.serverCancelled(own(event).fence.epoch);
    // Over: the status rests, unless audio still plays (tick rests it when playback
    // ends) or another answer streams. A turn still "thinking…" rests only on the end
    // of a response that began after the turn ended.
    const idle = !(this.player && this.player.busy);
    if (idle && this.state.status === "thinking…" && record.createdAt >= this.turnAt) this.rest();
    else if (idle && !this.streaming()) this.settle();
    const results = this.results || [];
    this.results = [];
    if (results.length && record.status === "completed") {
      for (const result of results) {
        this.send({
          type: "conversation.item.create",
          item: { type: "function_call_output", ...result },
        });
      }
      this.send({ type: "response.create" });
    }
  }

  onCancelled(event) {
    this.serverCancelled(own(event).fence.epoch);
    this.settle();
  }

  /** The server cancelled everything before ``epoch`` (a barge-in it applied). */
  serverCancelled(epoch) {
    this.minEpoch = Math.max(this.minEpoch, epoch);
    for (const record of Object.values(this.state.responses)) {
      if (record.epoch < epoch) record.cancelSeen = true;
    }
    const at = performance.now();
    this.bargeIn("cancelled", at);
    const pending = this.pendingBargeIn;
    if (pending) {
      pending.cancelledMs = Math.round(at - pending.at);
      this.state.latencies.bargeInCancelledMs = pending.cancelledMs;
      this.pendingBargeIn = null;
    }
  }

  // -- bookkeeping -------------------------------------------------------------------

  response(id, epoch = this.epoch) {
    let record = this.state.responses[id];
    if (!record) {
      record = {
        id,
        epoch,
        status: "in_progress",
        received: 0, // audio chunks that arrived
        scheduled: 0,
        played: 0, // audio chunks whose playback began
        dropped: 0,
        playedAfterStop: 0, // must stay 0: nothing of a cut response is heard
        receivedAfterCancel: 0, // deltas after the server said it was cancelled
        playedSec: 0,
        peakLevel: 0, // loudest output level measured while it played
        stopped: false,
        acked: false,
        createdAt: performance.now(), // response.created (or its first event) arrived
      };
      this.state.responses[id] = record;
    }
    return record;
  }

  beginTurn(trigger, at = performance.now()) {
    this.turnAt = at;
    this.pendingTurn = { trigger, at, firstDeltaMs: null, firstAudioMs: null };
  }

  markFirstDelta(audio) {
    const turn = this.pendingTurn;
    if (!turn) return;
    const ms = Math.round(performance.now() - turn.at);
    const lat = this.state.latencies;
    if (turn.firstDeltaMs === null) {
      turn.firstDeltaMs = lat.firstDeltaMs = ms;
      lat.turns.push(turn);
    }
    if (audio && turn.firstAudioMs === null) turn.firstAudioMs = lat.firstAudioMs = ms;
    if (turn.firstAudioMs !== null) this.pendingTurn = null;
  }

  /** An interruption: silence now; time the silence and, for a local one, the cancel. */
  bargeIn(trigger, at) {
    const silenced = this.stopPlayback(trigger);
    // Only a local interrupt waits for its cancel when nothing was playing.
    if (!silenced && trigger !== "interrupt") return;
    const record = {
      trigger,
      at,
      silenced,
      stopMs: silenced ? performance.now() - at : null, // every source stopped
      silenceMs: null, // the output meter read silence (set by tick)
      cancelledMs: trigger === "cancelled" ? 0 : null,
      voiceMs: null, // the user's voice onset (mic level) -> silence
    };
    this.state.latencies.bargeIns.push(record);
    if (silenced) this.awaitingSilence = record;
    if (trigger !== "cancelled") this.pendingBargeIn = record;
  }

  /** Called every tick with the output level: completes the silence figures. */
  measureSilence(level, now) {
    const record = this.awaitingSilence;
    if (!record || level >= SILENT_RMS) return;
    this.awaitingSilence = null;
    const lat = this.state.latencies;
    record.silenceMs = lat.bargeInSilenceMs = Math.round(now - record.at);
    const onset = this.voiceOnsetAt;
    if (record.trigger !== "interrupt" && onset !== null && now - onset < VOICE_WINDOW_MS) {
      record.voiceMs = lat.bargeInVoiceMs = Math.round(now - onset);
    }
  }

  /** Cut every scheduled chunk; true when something was playing or queued. */
  stopPlayback(reason) {
    if (!this.player || !this.player.busy) return false;
    const { now, cut } = this.player.stop();
    const ids = new Set(cut.map((e) => e.responseId));
    for (const id of ids) {
      const record = this.response(id);
      for (const entry of cut.filter((e) => e.responseId === id)) {
        if (entry.start < now) {
          record.playedSec += Math.min(now, entry.end) - entry.start;
          if (!entry.started) this.chunkBegan(entry);
        }
      }
      record.stopped = true;
      this.stopped.add(id);
      this.markCut(id);
      this.ack(record);
    }
    const unplayed = cut.filter((e) => e.start >= now).length;
    this.state.stops.push({ reason, responseIds: [...ids], cutChunks: unplayed, at: performance.now() });
    this.state.lastStopReason = reason;
    this.state.playing = false;
    this.state.speaking = false;
    $("playback").textContent = `stopped (${reason})`;
    this.settle();
    return true;
  }

  chunkBegan(entry) {
    const record = this.response(entry.responseId);
    if (record.stopped) record.playedAfterStop++;
    record.played++;
    this.state.audioChunksPlayed++;
  }

  ack(record) {
    if (record.acked || !record.received) return;
    record.acked = true;
    const played_ms = Math.round(record.playedSec * 1000);
    if (this.send({ type: "duplexq.playback.ack", response_id: record.id, played_ms })) {
      this.state.acks.push({ response_id: record.id, played_ms, stopped: record.stopped });
    }
  }

  tick() {
    if (!this.player) return;
    const level = this.player.level();
    this.state.outputLevel = level;
    this.measureSilence(level, performance.now());
    const { began, finished } = this.player.poll();
    // New audio began before the meter saw the gap: that silence went unmeasured.
    if (began.length) this.awaitingSilence = null;
    for (const entry of began) this.chunkBegan(entry);
    // The player's queue holds only chunks not yet finished: a started one is sounding.
    const sounding = this.player.queue.find((e) => e.started);
    if (sounding) {
      const record = this.response(sounding.responseId);
      record.peakLevel = Math.max(record.peakLevel, level);
    }
    for (const entry of finished) this.response(entry.responseId).playedSec += entry.end - entry.start;
    const busy = this.player.busy;
    this.state.playing = busy;
    // Speaking from the moment audio sounds until the queue has played out (a gap
    // between chunks still queued is part of it).
    const was = this.state.speaking;
    this.state.speaking = Boolean(sounding) || (was && busy);
    if (this.state.speaking) {
      $("playback").textContent = "playing";
      this.setStatus("speaking");
    } else if (was) {
      $("playback").textContent = "idle";
      if (this.state.status === "speaking") {
        if (this.streaming()) this.setStatus("answering");
        else this.rest();
      }
    }
    // A finished response whose audio has all played is acknowledged.
    const queued = new Set(this.player.queue.map((e) => e.responseId));
    for (const record of Object.values(this.state.responses)) {
      if (!record.acked && record.status !== "in_progress" && !queued.has(record.id)) {
        this.ack(record);
      }
    }
    this.renderLatency();
  }

  // -- rendering ---------------------------------------------------------------------

  addUserLine(text) {
    const state = this.state;
    state.transcript = state.transcript ? `${state.transcript}\n${text}` : text;
    const item = document.createElement("li");
    item.textContent = text;
    $("user-transcript").append(item);
  }

  addCallLine(text) {
    const item = document.createElement("li");
    item.className = "call";
    item.textContent = text;
    $("assistant-text").append(item);
  }

  /** Mark where an answer was cut: what follows was never heard. */
  markCut(responseId) {
    const item = document.querySelector(`#assistant-text li[data-id="${CSS.escape(responseId)}"]`);
    if (!item || item.classList.contains("cut")) return;
    item.classList.add("cut");
    const mark = document.createElement("span");
    mark.className = "cut-mark";
    mark.textContent = " ✂ cut off here";
    item.append(mark);
  }

  addAssistantText(responseId, text) {
    this.state.assistantText += text;
    let item = document.querySelector(`#assistant-text li[data-id="${CSS.escape(responseId)}"]`);
    if (!item) {
      item = document.createElement("li");
      item.dataset.id = responseId;
      $("assistant-text").append(item);
    }
    if (item.classList.contains("cut")) return; // nothing after the cut was heard
    item.append(document.createTextNode(text));
  }

  renderLatency() {
    const lat = this.state.latencies;
    const show = (id, ms) => ($(id).textContent = ms === null ? "–" : `${ms} ms`);
    show("lat-first-delta", lat.firstDeltaMs);
    show("lat-first-audio", lat.firstAudioMs);
    show("lat-silence", lat.bargeInSilenceMs);
    show("lat-cancelled", lat.bargeInCancelledMs);
    show("lat-voice", lat.bargeInVoiceMs);
  }
}

const HANDLERS = {
  "session.created": Demo.prototype.onSessionCreated,
  "duplexq.turn.trace": Demo.prototype.onTurnTrace,
  error: Demo.prototype.onError,
  "input_audio_buffer.speech_started": Demo.prototype.onSpeech,
  "input_audio_buffer.speech_stopped": Demo.prototype.onSpeech,
  "input_audio_buffer.committed": Demo.prototype.onCommitted,
  "conversation.item.input_audio_transcription.completed": Demo.prototype.onTranscription,
  "response.created": Demo.prototype.onResponseCreated,
  "response.output_text.delta": Demo.prototype.onDelta,
  "response.output_audio.delta": Demo.prototype.onDelta,
  "response.output_audio_transcript.delta": Demo.prototype.onDelta,
  "response.done": Demo.prototype.onResponseDone,
  "duplexq.response.cancelled": Demo.prototype.onCancelled,
  "response.function_call_arguments.done": Demo.prototype.onFunctionCall,
};

/** The page's built-in tool, offered when "Offer a tool" is checked. */
const CURRENT_TIME_TOOL = {
  type: "function",
  name: "get_current_time",
  description: "The current local date and time of the user.",
  parameters: { type: "object", properties: {} },
};

const TOOLS = {
  get_current_time: () => new Date().toString(),
};

/** duplexq's own fields of a server event (its ``duplexq`` object: seq, fence, stage). */
function own(event) {
  return event.duplexq || {};
}

new Demo();
