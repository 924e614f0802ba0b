// Playback of response audio: PCM chunks scheduled back to back on one
// AudioContext, cut all at once on an interruption.

export const OUTPUT_RATE = 24000;
const START_LEAD_S = 0.05; // first chunk of a run starts this far ahead

/** Schedules PCM chunks back to back on one AudioContext and can cut them all at once.
 *
 * Sources feed a gain node that is replaced on every stop; it feeds an analyser
 * (the level meter that shows playback really went silent) and the speakers. */
export class Player {
  constructor(ctx) {
    this.ctx = ctx;
    this.analyser = ctx.createAnalyser();
    this.analyser.fftSize = 256; // ~5 ms of audio per reading
    this.analyser.connect(ctx.destination);
    this.samples = new Float32Array(this.analyser.fftSize);
    this.output = null;
    this.queue = []; // {source, responseId, start, end, started}
    this.nextTime = 0;
  }

  /** RMS of what the graph played last (0 when silent). */
  level() {
    this.analyser.getFloatTimeDomainData(this.samples);
    let sum = 0;
    for (const s of this.samples) sum += s * s;
    return Math.sqrt(sum / this.samples.length);
  }

  get busy() {
    return this.queue.length > 0;
  }

  schedule(responseId, samples) {
    const ctx = this.ctx;
    if (!this.output) {
      this.output = ctx.createGain();
      this.output.connect(this.analyser);
    }
    const buffer = ctx.createBuffer(1, samples.length, OUTPUT_RATE);
    buffer.copyToChannel(samples, 0);
    const source = ctx.createBufferSource();
    source.buffer = buffer;
    source.connect(this.output);
    const start = Math.max(this.nextTime, ctx.currentTime + START_LEAD_S);
    source.start(start);
    this.nextTime = start + buffer.duration;
    this.queue.push({ source, responseId, start, end: this.nextTime, started: false });
  }

  /** Chunks that began and chunks that finished since the last poll. */
  poll() {
    const now = this.ctx.currentTime;
    const began = [];
    const finished = [];
    for (const entry of this.queue) {
      if (!entry.started && entry.start <= now) {
        entry.started = true;
        began.push(entry);
      }
      if (entry.end <= now) finished.push(entry);
    }
    if (finished.length) this.queue = this.queue.filter((e) => e.end > now);
    return { now, began, finished };
  }

  /** Silence now: stop and disconnect every source; return what was cut. */
  stop() {
    const now = this.ctx.currentTime;
    for (const entry of this.queue) {
      try {
        entry.source.stop();
      } catch {
        // a source that already ended
      }
      entry.source.disconnect();
    }
    if (this.output) {
      this.output.disconnect();
      this.output = null;
    }
    const cut = this.queue;
    this.queue = [];
    this.nextTime = 0;
    return { now, cut };
  }
}
